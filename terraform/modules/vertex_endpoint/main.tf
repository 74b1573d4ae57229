# Vertex AI: the model bucket, a service account that may only read it, an endpoint, and ferry's
# image deployed to it with autoscaling bounds. The Google provider has no resource that uploads a
# custom-container model or deploys it, so those two steps run gcloud (which must be installed
# and logged in where terraform runs), rerun whenever the image or a setting changes.

data "google_project" "this" {
  project_id = var.project
}

resource "google_storage_bucket" "models" {
  project                     = var.project
  name                        = var.model_bucket
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  versioning {
    enabled = true
  }
}

resource "google_service_account" "ferry" {
  project      = var.project
  account_id   = "${var.name}-serving"
  display_name = "ferry serving ${var.name} on Vertex AI"
}

# Least privilege: read-only on the model bucket, for ferry and for Vertex AI's service agent
# (which copies the artifacts at upload).
resource "google_storage_bucket_iam_member" "ferry_reads_models" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.ferry.email}"
}

resource "google_storage_bucket_iam_member" "vertex_reads_models" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:service-${data.google_project.this.number}@gcp-sa-aiplatform.iam.gserviceaccount.com"
}

resource "google_vertex_ai_endpoint" "ferry" {
  project      = var.project
  name         = var.name
  display_name = var.name
  location     = var.region
  region       = var.region
  # gRPC and streamed predictions reach the container only on a dedicated endpoint.
  dedicated_endpoint_enabled = var.grpc_port > 0
}

locals {
  artifact_uri = "gs://${google_storage_bucket.models.name}/${var.model_prefix}"
  env_model    = var.default_model == "" ? "FERRY_LOG_FORMAT=json" : "FERRY_LOG_FORMAT=json,FERRY_VERTEX_AI_DEFAULT_MODEL=${var.default_model}"
  env_vars     = var.grpc_port > 0 ? "${local.env_model},FERRY_VERTEX_AI_GRPC_PORT=${var.grpc_port}" : local.env_model
  grpc_ports   = var.grpc_port > 0 ? "--container-grpc-ports=${var.grpc_port}" : ""
  accelerator  = var.accelerator_type == "" ? "" : "--accelerator=type=${lower(replace(var.accelerator_type, "_", "-"))},count=${var.accelerator_count}"
  metrics      = var.accelerator_type == "" ? "cpu-usage=${var.target_utilization}" : "cpu-usage=${var.target_utilization},gpu-duty-cycle=${var.target_utilization}"
}

resource "terraform_data" "deployment" {
  triggers_replace = [
    var.image_uri, local.artifact_uri, var.machine_type, var.accelerator_type, var.accelerator_count,
    var.min_replicas, var.max_replicas, var.target_utilization, local.env_vars,
  ]

  provisioner "local-exec" {
    interpreter = ["bash", "-c"]
    command     = <<-EOT
      set -euo pipefail
      model=$(gcloud ai models upload --project=${var.project} --region=${var.region} \
        --display-name=${var.name} --container-image-uri=${var.image_uri} \
        --artifact-uri=${local.artifact_uri} --container-ports=8080 ${local.grpc_ports} \
        --container-env-vars=${local.env_vars} --format='value(model)')
      gcloud ai endpoints deploy-model ${google_vertex_ai_endpoint.ferry.name} --project=${var.project} \
        --region=${var.region} --model="$${model##*/}" --display-name=${var.name} \
        --service-account=${google_service_account.ferry.email} --machine-type=${var.machine_type} \
        ${local.accelerator} --min-replica-count=${var.min_replicas} --max-replica-count=${var.max_replicas} \
        --autoscaling-metric-specs=${local.metrics} --traffic-split=0=100
    EOT
  }

  depends_on = [google_storage_bucket_iam_member.ferry_reads_models, google_storage_bucket_iam_member.vertex_reads_models]
}
